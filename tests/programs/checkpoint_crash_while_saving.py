"""tests/test_checkpoint.py's crash: save a complete checkpoint at step 3 into CKPT, then die
(exit status 9) at the commit point of the save at step 6, every file written, nothing renamed.

    python tests/programs/checkpoint_crash_while_saving.py CKPT
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: the helpers package
import helpers.checkpoint_variants as tc  # noqa: E402
import helpers.engine_toys as toys  # noqa: E402

ckpt = sys.argv[1]
engine = tc._engine("adamw")
toys.train(engine, range(3))
engine.save_checkpoint(ckpt)                      # global_step3: complete
toys.train(engine, range(3, 6))
# Die at the commit point of the next save: every file is written, nothing is renamed yet.
os.rename = lambda *a, **k: os._exit(9)
engine.save_checkpoint(ckpt)                      # global_step6: never completes
