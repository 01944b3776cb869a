# adpfleet runtime image: `adpfleet serve` and `adpfleet router` (with torch).
# Build from the repository root:  docker build -f docker/runtime.Dockerfile -t adpfleet-runtime .
# For GPUs, build FROM a CUDA base with the same layout; torch from PyPI already carries CUDA libraries.

FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY adpfleet adpfleet
COPY runtime runtime
COPY operator operator
COPY cluster cluster
RUN pip install --no-cache-dir build==1.3.0 && python -m build --wheel --outdir /wheels

FROM python:3.11.14-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 ADPFLEET_KERNEL_DIR=/opt/adpfleet/kernels
COPY --from=build /wheels /wheels
# g++ only for as long as it takes to build the CPU attention kernel against this torch (~15 s)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && pip install --no-cache-dir "$(ls /wheels/adpfleet-*.whl)[runtime]" && rm -rf /wheels \
    && python -m adpfleet.runtime.model.kernels \
    && apt-get purge -y --auto-remove g++ && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin adpfleet
USER 10001:10001
EXPOSE 8000 8001
ENTRYPOINT ["adpfleet"]
CMD ["serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "8000"]
