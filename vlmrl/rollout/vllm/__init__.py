"""vLLM rollouts: the engine (colocated `vllm.LLM` or `AsyncLLM`, or a vLLM server), token/image conversions and
weight transfer. The only modules of vlmrl that import vllm (inside functions: the package loads without it)."""
