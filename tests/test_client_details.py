"""Details DeepSpeed clients run into (issue 26): a GradScaler overflow is ordinary (INFO, with
the scale), the model's state_dict() after close(), and `zenflow --help` in full."""
import logging
import subprocess
import sys

import torch

import zenflow
from zenflow.engine.engine import initialize
from zenflow.tools import cli

import helpers.engine_toys as toys


def test_grad_scaler_overflow_logs_info_with_the_scale_and_bad_gradients_warn(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    with zenflow.ZenFlowAdamW(model.parameters(), worker=False, update_interval=2) as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        with caplog.at_level(logging.INFO, logger="zenflow"):
            scaler.scale(model(torch.randn(4, 6)).sum()).backward()
            model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        records = [r for r in caplog.records if "overflow" in r.getMessage()]
        assert [r.levelno for r in records] == [logging.INFO]
        assert "gradient overflow at loss scale 1024: step 0 skipped" in records[0].getMessage()
        assert scaler.get_scale() == 512.0
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zenflow"):  # no scaler: a real problem
            opt.zero_grad()
            model(torch.randn(4, 6)).sum().backward()
            model[0].weight.grad[0, 0] = float("nan")
            opt.step()
        assert [r.levelno for r in caplog.records if "not finite" in r.getMessage()] == \
            [logging.WARNING]


def test_model_state_dict_after_close_returns_the_weights_as_they_are():
    for close in ("engine", "optimizer"):
        model = toys.make_model()
        engine, optimizer, *_ = initialize(model=model, config=toys.config("zenflow"))
        toys.train(engine, range(6))
        (engine if close == "engine" else optimizer).close()
        state = model.state_dict()   # used to raise "ZenFlow host worker: used after close()"
        for name, p in model.named_parameters():
            assert torch.equal(state[name], p.detach()), (close, name)
        engine.close()


def test_zenflow_help_is_complete():
    run = subprocess.run([sys.executable, "-m", "zenflow", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    squeeze = lambda s: "".join(s.split())   # argparse wraps lines (and after hyphens)
    text = squeeze(run.stdout)
    assert squeeze(cli.DESCRIPTION) in text and text.endswith(squeeze(cli.EPILOG))
    for name, (_, help_text) in cli.SUBCOMMANDS.items():
        assert squeeze(name + help_text) in text, name
