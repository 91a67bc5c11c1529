"""Data: corpora prepared offline into token shards (`prepare`, `shards`), the byte- and token-level corpora of the
recipes (`corpus`), chat/instruction data for fine-tuning (`sft`, `chat_formats`) and the record readers under them
(`record_files`). Imports nothing heavy itself: ``python -m lightning_hybrid.data.prepare`` needs no torch."""
