"""A fake ``tensorrt_llm`` (and ``tensorrt``) package for contract tests on machines without
TensorRT-LLM. It mirrors the 1.x signatures read upstream (each module names the file and
commit it follows) and records what it was asked to do. See ``support.py`` for fixtures."""
