"""Other projects' formats: what goes in from, and out to, Hugging Face, torch and public corpora.

    hf_names      titanlite's tensor and config names <-> Llama's in transformers
    hf_moe        the same for Mixtral (a mixture of experts)
    hf_start      `--checkpoint.initial_load_path`: a run that starts from a published folder
    export        a checkpoint as one torch file or a Hugging Face folder, and back
    corpora       public corpora fetched into data/ (the trainer itself reads only local files)

May import the core only."""
