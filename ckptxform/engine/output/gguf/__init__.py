"""A GGUF output (``output.format: gguf``): one llama.cpp ``.gguf`` file, written as the
safetensors shards are.

Everything before the tensor data (magic, metadata key/values, tensor infos, padding to
the alignment) depends only on the plan and the source's small files, so it is the
shard's header (``layout.py``), built with gguf-py's own writer; the tensors then stream
to their aligned offsets like any shard's, a band at a time, so memory is bounded by a
band and there is no second copy on disk. The key/values are those llama.cpp's
``convert_hf_to_gguf.py`` writes: ``general.*`` through gguf-py's ``Metadata``, the
family's hyperparameters (``llama.py``) and the tokenizer (``spm_vocab.py``).
"""
