"""What the stages read and write besides hidden states; imports only ``core``.

    prompts.py        prompt files (JSONL), chat templates, end-of-turn ids; assets/ holds the shipped prompts
    responses.py      the response shard schema
    shards.py         Parquet shard sets written atomically, manifest last
    subsets.py        fixed seeded subsets, per-source-file selections, data mixes
    long_context.py   generated long-context prompts (a document and a question about it), sized in target tokens
    hf_extractor.py   hidden states with transformers (the fallback extractor)
    target_model.py   the target's HF folder (SmolLM2 converted once from its GGUF), its layer count
"""
