"""A training script written the way DeepSpeed's Getting Started tutorial writes one, with
`import zenflow as deepspeed` as its only change. Run by tests/test_deepspeed_compat.py as
`python ds_getting_started.py --deepspeed --deepspeed_config CFG --save_dir D --out O` and under
`torchrun --nproc_per_node 2`. It writes O/rank<r>.json (losses, ranks, checkpoint answers) and
O/rank<r>.pt (final weights)."""
import argparse
import json
import os

import torch

import zenflow as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="My training script.")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--save_dir", required=True, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="where to write this rank's results")
    parser.add_argument("--epochs", type=int, default=2)
    # Include DeepSpeed configuration arguments
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4] * 2).argmax(1))


def evaluate(model_engine, data):
    model_engine.eval()
    x, y = data.tensors
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model_engine(x.to(model_engine.device)),
                                                 y.to(model_engine.device)).item()
    model_engine.train()
    return loss


def main():
    # The test also runs it without this line under torchrun: initialize() must then set up
    # the process group itself, as deepspeed.initialize does, or the ranks would train alone.
    if os.environ.get("SKIP_INIT_DISTRIBUTED") != "1":
        deepspeed.init_distributed()
    cmd_args = add_argument()
    torch.manual_seed(0)
    model = Net()
    params = filter(lambda p: p.requires_grad, model.parameters())
    data = dataset()
    model_engine, optimizer, data_loader, _ = deepspeed.initialize(
        args=cmd_args, model=model, model_parameters=params, training_data=data)
    device = deepspeed.get_accelerator().device_name(model_engine.local_rank)
    rank = deepspeed.comm.get_rank()
    result = {"rank": rank, "global_rank": model_engine.global_rank,
              "world_size": model_engine.world_size, "dp_world_size": model_engine.dp_world_size,
              "local_rank": model_engine.local_rank, "zero_stage": model_engine.zero_optimization_stage(),
              "missing_checkpoint": list(model_engine.load_checkpoint(cmd_args.save_dir)),
              "eval_before": evaluate(model_engine, data), "losses": []}

    client_sd = {}
    for epoch in range(cmd_args.epochs):
        for step, batch in enumerate(data_loader):
            # forward() method
            loss = torch.nn.functional.cross_entropy(model_engine(batch[0].to(device)),
                                                     batch[1].to(device))
            # runs backpropagation
            model_engine.backward(loss)
            # weight update
            model_engine.step()
            result["losses"].append(loss.item())
        # save checkpoint
        client_sd["epoch"] = epoch
        ckpt_id = f"epoch{epoch}"
        model_engine.save_checkpoint(cmd_args.save_dir, ckpt_id, client_state=client_sd)
    result["eval_after"] = evaluate(model_engine, data)
    result["grad_norm"] = model_engine.get_global_grad_norm()

    # load checkpoint into a fresh engine, as a restarted job would
    torch.manual_seed(1)
    fresh_model = Net()
    fresh, _, _, _ = deepspeed.initialize(args=cmd_args, model=fresh_model,
                                          model_parameters=fresh_model.parameters())
    path, client_sd = fresh.load_checkpoint(cmd_args.save_dir)
    result["loaded"] = [os.path.basename(path), client_sd]
    result["eval_loaded"] = evaluate(fresh, data)
    os.makedirs(cmd_args.out, exist_ok=True)
    torch.save({k: v.cpu() for k, v in model_engine.module.state_dict().items()},
               os.path.join(cmd_args.out, f"rank{rank}.pt"))
    with open(os.path.join(cmd_args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    fresh.destroy()
    model_engine.destroy()


if __name__ == "__main__":
    main()
