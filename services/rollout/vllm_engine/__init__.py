"""vLLM's V1 engine behind rhymerl's WorkerService (worker setting engine=vllm).

vLLM is imported lazily, in the modules that need it, so nothing else in
services/ requires it installed. See docs/vllm.md.
"""
