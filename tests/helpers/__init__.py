"""What the tests share: models, data, reference runs, rank code and child-process plumbing.

Test files import from here (`from helpers.models import MODELS`), never from one another or from
conftest.py, which holds only fixtures. pyproject.toml's `pythonpath = ["tests"]` puts tests/ on
sys.path, so `import helpers` works in the tests, in the ranks they spawn (which inherit sys.path)
and in tests/programs/ (which put tests/ on sys.path themselves where they need it).

    models.py           the MLP and the transformer block most optimizer tests train (MODELS)
    equivalence.py      training loops and tolerances of the "ZenFlow is AdamW when..." tests
    reference.py        random settings and a run against zenflow.optim.reference (run_pair);
                        "factored" with every sum on the device beside it (factored_against_reference)
    state_dict_runs.py  a run that saves and resumes mid-way through state_dict()
    host_update.py      a host state and its update in separate passes (the one-pass oracle)
    decisions.py        window lengths from an optimizer's decisions
    llama.py            the Llama-shaped model (226 matrices) and its batches
    engine_toys.py      tiny models, data and configs of the engine and checkpoint tests
    checkpoint_variants.py  the engine configurations the checkpoint tests save and resume
    integrations.py     the tiny BERT, the Lightning module and the settings of the framework tests
    autograd_thread.py  the backward on a thread of its own, as CUDA runs it
    children.py         tests/programs/ and the environment child processes run in
    spawn.py            spawning gloo ranks on 127.0.0.1 and checking what they wrote
    rank_pool.py        the session's rank processes spawn.py runs them in (torch imported once)
    dist_ranks.py       code that runs inside the DDP and engine ranks
    fsdp_ranks.py       code that runs inside the FSDP2 ranks
    ddp_factored_ranks.py  code that runs inside the DDP ranks of deferred_credit="factored", and
                        the reference fitted per row block they (and FSDP2's ranks) equal
    fsdp_frameworks.py  code that runs inside the FSDP2 ranks of Accelerate and Lightning
    collective_check.py collectives checked against a declared backend (NCCL on a CPU)
"""
