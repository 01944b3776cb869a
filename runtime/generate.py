"""`adpfleet generate`: one completion on the command line, no server."""

from __future__ import annotations


def main(args) -> int:
    from adpfleet.runtime.config import EngineConfig
    from adpfleet.runtime.engine.llm_engine import LLMEngine
    from adpfleet.runtime.engine.sampling import SamplingParams
    from adpfleet.runtime.model.sources.fetch import resolve_model

    model = resolve_model(args.model, args.cache_dir)
    engine = LLMEngine(EngineConfig.from_args(args).with_model(model.path))
    [req] = engine.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens,
                                                          temperature=args.temperature))
    print(req.output_text)
    return 0
