"""Code that runs inside the ranks of tests/test_fsdp2_frameworks.py (spawned, gloo):
ZenFlowAdamW on an FSDP2 model driven by Accelerate's FSDP2 plugin and by Lightning's
ModelParallelStrategy, and zenflow.initialize on an FSDP2 model with a stage 0 or 2 DeepSpeed
config. Every run trains the tests' MLP on the batches of helpers/dist_ranks.py (my_share of the
global batch per step)."""
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zenflow

from helpers.dist_ranks import engine_config, my_share, optimizer_kwargs
from helpers.fsdp_ranks import _engine_steps, full_weights, selections, sharded_mlp
from helpers.models import make_mlp


def _kwargs(overlap: bool) -> dict:
    return dict(optimizer_kwargs(overlap), weight_decay=0.01, worker=False)


# ------------------------------------------------------------------------------- Accelerate
def _accelerator(device_placement: bool = True):
    """An Accelerator with the FSDP2 plugin. Accelerate turns the plugin on only where it finds
    GPUs (accelerate/state.py: MULTI_GPU and the like); on the CPU it silently runs DDP instead.
    These lines set its state to what a 2-GPU node gets, so that prepare(), save_state and
    load_state take their FSDP2 paths on gloo as they do on NCCL."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    plugin = accelerate.FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin,
                                         device_placement=device_placement)
    # (AcceleratorState copies PartialState's type whenever one is made: both say FSDP.)
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def _accelerate_prepared(accelerator, overlap: bool):
    """The supported order: the plugin shards the model first, ZenFlowAdamW is built over the
    shards, and both go to prepare() together (which FSDP2 requires)."""
    from accelerate.utils import fsdp2_prepare_model
    model = fsdp2_prepare_model(accelerator, make_mlp())
    opt = zenflow.ZenFlowAdamW(model.parameters(), **_kwargs(overlap))
    return accelerator.prepare(model, opt)


def _accelerate_steps(accelerator, model, opt, start, stop, rank, world):
    for t in range(start, stop):
        x, y = my_share(t, rank, world)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def _accelerate(rank, world, steps, options, result):
    """STEPS steps with a save_state at the half (overlapped: an update in flight); a fresh
    Accelerator, model and optimizer that load_state and train the second half; and the order
    that cannot work (the optimizer built over the unsharded model), refused by name."""
    path = options["dir"]
    accelerator = _accelerator()
    model, opt = _accelerate_prepared(accelerator, overlap=True)
    result["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    in_groups = [p for g in opt.param_groups for p in g["params"]]
    result["same_params"] = (len(in_groups) == len(list(model.parameters())) and all(
        a is b for a, b in zip(in_groups, model.parameters())))
    _accelerate_steps(accelerator, model, opt, 0, steps // 2, rank, world)
    accelerator.save_state(path)
    _accelerate_steps(accelerator, model, opt, steps // 2, steps, rank, world)
    result["continued"] = full_weights(model)
    result["selections"] = selections(zenflow.find_optimizer(opt))
    zenflow.find_optimizer(opt).close()

    # As docs/fsdp2.md advises on GPUs: no round trip of the optimizer's state at prepare().
    accelerator = _accelerator(device_placement=False)
    model, opt = _accelerate_prepared(accelerator, overlap=True)
    accelerator.load_state(path)
    result["loaded_step"] = zenflow.find_optimizer(opt).counters.step
    _accelerate_steps(accelerator, model, opt, steps // 2, steps, rank, world)
    result["resumed"] = full_weights(model)
    zenflow.find_optimizer(opt).close()

    accelerator = _accelerator()
    model = make_mlp()
    with zenflow.ZenFlowAdamW(model.parameters(), **_kwargs(False)) as opt:
        model, prepared = accelerator.prepare(model, opt)
        result["unsharded_first"] = None
        try:
            _accelerate_steps(accelerator, model, prepared, 0, 1, rank, world)
        except ValueError as exc:
            result["unsharded_first"] = str(exc)
        result["untouched"] = opt.counters.step == 0


# -------------------------------------------------------------------------------- Lightning
def _lightning(rank, world, steps, options, result):
    """Lightning's ModelParallelStrategy (fully_shard in configure_model, ZenFlowAdamW from
    configure_optimizers, checkpoints through DCP): STEPS steps with the project's callback
    (which installs the update in flight at the end); STEPS steps saving a checkpoint at the
    half, and a fresh Trainer resuming from it; the same two with the callback."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from zenflow.integrations.lightning_callback import ZenFlowLightningCallback

    class Sharded(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_mlp()

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            # The step's batch by the step's number, so a resumed run (which Lightning restarts
            # at the beginning of its epoch's data) sees the batches the saving run saw.
            x, y = my_share(self.global_step, rank, world)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            self.zenflow = zenflow.ZenFlowAdamW(self.parameters(), **_kwargs(overlap=True))
            return self.zenflow

    def fit(callbacks, ckpt_path=None):
        module = Sharded()
        trainer = L.Trainer(
            accelerator="cpu", devices=world, max_steps=steps, logger=False,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            callbacks=callbacks, enable_checkpointing=any(
                isinstance(c, ModelCheckpoint) for c in callbacks),
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
            default_root_dir=options["dir"])
        trainer.fit(module, torch.utils.data.DataLoader(range(steps), batch_size=None),
                    ckpt_path=ckpt_path)
        out = {"weights": full_weights(module.net), "selections": selections(module.zenflow),
               "step": trainer.global_step}
        module.zenflow.close()
        return out

    def at_half(name):
        return ModelCheckpoint(dirpath=os.path.join(options["dir"], name), filename="{step}",
                               every_n_train_steps=steps // 2, save_top_k=-1)

    def half(name):
        return os.path.join(options["dir"], name, f"step={steps // 2}.ckpt")

    result["callback"] = fit([ZenFlowLightningCallback()])
    result["saving"] = fit([at_half("plain")])
    result["is_dcp"] = os.path.isfile(os.path.join(half("plain"), ".metadata"))
    result["resumed"] = fit([], ckpt_path=half("plain"))
    # With the callback, the checkpoint holds the update in flight installed (as the saving run
    # continues after it): the resumed run continues the same way.
    result["callback_saving"] = fit([ZenFlowLightningCallback(), at_half("callback")])
    result["callback_resumed"] = fit([ZenFlowLightningCallback()], ckpt_path=half("callback"))


# ------------------------------------------------------------------- the engine, stages 0-2
def _engine_low_stage(rank, world, steps, options, result):
    """zenflow.initialize on an FSDP2 model with the DDP tests' stage 2 config (and stage 0)."""
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zenflow.engine").addHandler(handler)
    logging.getLogger("zenflow.engine").setLevel(logging.INFO)
    for stage in (2, 0):
        config = engine_config(False, world)
        config["zero_optimization"]["stage"] = stage
        engine, opt, _, _ = zenflow.initialize(model=sharded_mlp(), config=config)
        _engine_steps(engine, 0, steps, rank, world)
        engine.save_checkpoint(options["dir"], tag=f"stage{stage}")
        result[stage] = {"weights": full_weights(engine.module), "selections": selections(opt),
                         "dcp": os.path.isfile(os.path.join(options["dir"], f"stage{stage}",
                                                            "distributed_checkpoint", ".metadata"))}
        engine.close()
    result["log"] = records


MODES = {"accelerate": _accelerate, "lightning": _lightning, "engine": _engine_low_stage}


def frameworks_rank_main(rank: int, world: int, port: int, out_dir: str, steps: int,
                         options: dict):
    """Every mode in options["modes"] on one set of ranks; result[mode] is its result. The
    frameworks find the process group through the variables torchrun sets."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    result = {}
    try:
        for mode in options["modes"]:
            result[mode] = {}
            MODES[mode](rank, world, steps, {"dir": os.path.join(out_dir, mode)}, result[mode])
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
