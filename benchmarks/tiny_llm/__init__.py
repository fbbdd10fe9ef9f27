"""The tiny LLM rhymerl is measured on (the RL "policy" model, not a placement policy):
a small Llama/Qwen-style model trained here from scratch on the synthetic reasoning task of `clients/python/examples/reasoning_task.py`.

- tokenizer.py: the task's closed-vocabulary tokenizer, in Hugging Face `tokenizers` format.
- train_sft.py: supervised warm-up on worked answers; writes an HF-loadable checkpoint.
- local_client.py: an in-process stand-in for the rhymerl SDK client (samples with the HF
  model directly), for testing the example GRPO trainer and recording CPU traces.

- examples.py: loads the SDK's example scripts (the task, the GRPO trainer) by name.
- checkpoint.py: the trained checkpoint (models/tiny), trained on first use.
"""

