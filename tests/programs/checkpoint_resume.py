"""tests/test_checkpoint.py's fresh process: for each VARIANT, load ROOT/VARIANT (saved at step
10), train steps 10-19, and write the weights and counters to ROOT/VARIANT.resumed.{pt,json}.

    python tests/programs/checkpoint_resume.py ROOT VARIANT...
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: the helpers package
import helpers.checkpoint_variants as tc  # noqa: E402
import helpers.engine_toys as toys  # noqa: E402

root, variants = sys.argv[1], sys.argv[2:]
for variant in variants:
    engine = tc._engine(variant, model_seed=99)  # other initial weights: they must be replaced
    path, client = engine.load_checkpoint(root + "/" + variant)
    assert client == {"note": "step 10"}, client
    toys.train(engine, range(10, 20))
    engine.synchronize()
    out = root + "/" + variant + ".resumed"
    torch.save(toys.weights(engine.module), out + ".pt")
    json.dump(tc._counters(engine), open(out + ".json", "w"))
    engine.close()
