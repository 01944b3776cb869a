# adpfleet operator image: `adpfleet operator` and `adpfleet crds`, without torch.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t adpfleet-operator .

FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY adpfleet adpfleet
COPY runtime runtime
COPY operator operator
COPY cluster cluster
RUN pip install --no-cache-dir build==1.3.0 && python -m build --wheel --outdir /wheels

FROM python:3.11.14-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/adpfleet-*.whl)[operator]" && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin adpfleet
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["adpfleet", "operator"]
