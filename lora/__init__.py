"""LoRA, an optional concept in one folder: adapters.py (the adapters injected before sharding, the
reference as an adapter or none) and sync.py (the adapter out of the trainer: into the servers,
into the exports). `rm -r lora` leaves a trainer that runs everything but --lora_rank.

Its doors: the only places in the trainer that import it, each only when lora_rank > 0 (a plain run
imports neither file):
- train.py:model_doors         adapters.add_adapters, the converter infra.parallel.load_model runs
                               before the sharding
- reference.py:make_reference  the base (adapters.WithAdapter(policy, None)) or the EMA adapter
- train.py:check_model         adapters.check, on the meta model, before anything starts
- train.py:announce            adapters.describe, the start-up line
- train.py:export_transform    sync.export, which infra.checkpoint.export runs: PEFT's adapter
                               directory, and the adapter merged in
- train.py:make_sync           sync.make_weight_sync, which the generator makes: the adapter's sync
                               (its server_flags go to the server we launch) or the merged weights'
and, for a server you run, scripts/serve.py:main (sync.server_flags). config.py holds the lora_*
fields and their checks; update.py reads lora_dropout (update.dropout switches on, in the forward
that takes a gradient, the modules add_adapters marks `dropout_in_training`; the sync check's
dropout-free logprobs).
"""
