# Opacus's examples/mnist.py (github.com/pytorch/opacus, Apache-2.0): the model and train() as
# written there; main() with synthetic digits in place of torchvision's MNIST download and
# without the test set, run for a few steps (benchmarks/opacus_switch.py).

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from opacus import PrivacyEngine
from tqdm import tqdm

from _synthetic import images, mean_loss


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        # x of shape [B, 1, 28, 28]
        x = F.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = F.relu(self.fc1(x))  # -> [B, 32]
        x = self.fc2(x)  # -> [B, 10]
        return x

    def name(self):
        return "SampleConvNet"


def train(args, model, device, train_loader, optimizer, privacy_engine, epoch):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _batch_idx, (data, target) in enumerate(tqdm(train_loader)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    if not args.disable_dp:
        epsilon = privacy_engine.accountant.get_epsilon(delta=args.delta)
        print(
            f"Train Epoch: {epoch} \t"
            f"Loss: {np.mean(losses):.6f} "
            f"(ε = {epsilon:.2f}, δ = {args.delta})"
        )
    else:
        print(f"Train Epoch: {epoch} \t Loss: {np.mean(losses):.6f}")


def main(args):
    device = torch.device(args.device)
    train_set = images(args.n, (1, 28, 28))
    train_loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.batch_size,
        num_workers=0,
        pin_memory=True,
    )
    eval_loader = torch.utils.data.DataLoader(train_set, batch_size=256)

    model = SampleConvNet().to(device)

    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)
    privacy_engine = None

    if not args.disable_dp:
        privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
        model, optimizer, train_loader = privacy_engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=train_loader,
            noise_multiplier=args.sigma,
            max_grad_norm=args.max_per_sample_grad_norm,
        )

    loss_before = mean_loss(model, eval_loader)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, privacy_engine, epoch)
    return privacy_engine, loss_before, mean_loss(model, eval_loader)


ARGS = dict(n=256, batch_size=64, epochs=3, lr=0.1, sigma=1.0, max_per_sample_grad_norm=1.0,
            delta=1e-5, device="cpu", disable_dp=False, secure_rng=False)
