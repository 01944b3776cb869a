"""The engines a fleet's servers can run: the operator's `spec.engine` values, and what it passes to
`adpfleet fetch-model --engine` so the model check judges the model by the engine that will load it."""

ADPFLEET, VLLM = "adpfleet", "vllm"
ENGINES = (ADPFLEET, VLLM)
