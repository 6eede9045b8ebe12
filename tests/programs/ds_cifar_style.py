"""A training script written the way DeepSpeed's CIFAR-10 tutorial writes one (cifar10_deepspeed.py,
abridged to a tiny net and synthetic images), unchanged: `import deepspeed`, `from
deepspeed.accelerator import get_accelerator`, `from deepspeed import comm as dist`, the MoE
parameter split, a `test()` under no_grad, and the Getting Started checkpoint with
`ckpt_id = loss.item()` (a different tag on each rank). Run by tests/test_deepspeed_launch.py
through `zenflow launch`. Writes O/rank<r>.json."""
import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--log-interval", type=int, default=4, help="output logging interval")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc3(x)


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 8, 8, generator=g)
    return torch.utils.data.TensorDataset(images, (images[:, 0, :2, :2].reshape(n, 4)).argmax(1))


def test(model_engine, testset, local_device, target_dtype):
    testloader = torch.utils.data.DataLoader(testset, batch_size=16, shuffle=False)
    correct, total, loss = 0, 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            loss += F.cross_entropy(outputs.float(), labels.to(local_device), reduction="sum").item()
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(predicted.device)).sum().item()
    return correct / total, loss / total


def main(args):
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset, testset = dataset(128, 0), dataset(64, 1)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    result = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "losses": []}
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            result["losses"].append(loss.item())
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
        # Getting Started's checkpoint: the loss as the tag, a different one on each rank
        ckpt_id = loss.item()
        model_engine.save_checkpoint(args.save_dir, ckpt_id, client_state={"epoch": epoch})
    result["accuracy"], result["test_loss"] = test(model_engine, testset, local_device, target_dtype)
    result["weights"] = {k: v.tolist() for k, v in model_engine.module.state_dict().items()}

    # resume in a fresh engine, as a restarted job would
    fresh_net = Net()
    fresh, _, _, _ = deepspeed.initialize(args=args, model=fresh_net,
                                          model_parameters=fresh_net.parameters())
    path, client_sd = fresh.load_checkpoint(args.save_dir)
    result["loaded"] = [os.path.basename(path), client_sd]
    result["resumed_accuracy"], result["resumed_test_loss"] = test(fresh, testset, local_device,
                                                                   target_dtype)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    fresh.destroy()
    model_engine.destroy()


args = add_argument()
main(args)
