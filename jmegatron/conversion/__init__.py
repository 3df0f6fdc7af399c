"""Weight and config mappings between jmegatron and other formats, in numpy: Hugging Face
(:mod:`~jmegatron.conversion.hf`, :mod:`~jmegatron.conversion.hf_moe`), Megatron-LM
(:mod:`~jmegatron.conversion.megatron`), TensorRT-LLM (:mod:`~jmegatron.conversion.trtllm`)
and the parameter-tree helpers they share
(:mod:`~jmegatron.conversion.tree`). Reading and writing files (safetensors, torch,
transformers, TensorRT-LLM) is left to :mod:`jmegatron.checkpoint` and the commands of
``jmegatron.export``."""
