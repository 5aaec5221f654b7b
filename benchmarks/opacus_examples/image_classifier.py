# Opacus's tutorials/building_image_classifier.ipynb (github.com/pytorch/opacus, Apache-2.0):
# ModuleValidator.fix, make_private_with_epsilon, BatchMemoryManager and train() as written
# there. torchvision's resnet18 does not load beside the CPU torch wheel, so a small CNN with
# BatchNorm (which ModuleValidator.fix replaces) stands in for it; synthetic 3x32x32 images
# replace the CIFAR10 download; sizes are scaled down (benchmarks/opacus_switch.py).

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.validators import ModuleValidator

from _synthetic import images, mean_loss

MAX_GRAD_NORM = 1.2
EPSILON = 50.0
DELTA = 1e-5
EPOCHS = 3

LR = 1e-3
BATCH_SIZE = 64
MAX_PHYSICAL_BATCH_SIZE = 16


def small_cnn(num_classes=10):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, num_classes),
    )


def accuracy(preds, labels):
    return (preds == labels).mean()


def train(model, train_loader, optimizer, epoch, device):
    model.train()
    criterion = nn.CrossEntropyLoss()

    losses = []
    top1_acc = []

    with BatchMemoryManager(
        data_loader=train_loader,
        max_physical_batch_size=MAX_PHYSICAL_BATCH_SIZE,
        optimizer=optimizer
    ) as memory_safe_data_loader:

        for i, (images, target) in enumerate(memory_safe_data_loader):
            optimizer.zero_grad()
            images = images.to(device)
            target = target.to(device)

            # compute output
            output = model(images)
            loss = criterion(output, target)

            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()

            # measure accuracy and record loss
            acc = accuracy(preds, labels)

            losses.append(loss.item())
            top1_acc.append(acc)

            loss.backward()
            optimizer.step()

            if (i+1) % 200 == 0:
                epsilon = privacy_engine.get_epsilon(DELTA)
                print(
                    f"\tTrain Epoch: {epoch} \t"
                    f"Loss: {np.mean(losses):.6f} "
                    f"Acc@1: {np.mean(top1_acc) * 100:.6f} "
                    f"(ε = {epsilon:.2f}, δ = {DELTA})"
                )


def main(args):
    global privacy_engine
    train_dataset = images(args.n, (3, 32, 32))
    train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=BATCH_SIZE,
    )
    eval_loader = torch.utils.data.DataLoader(train_dataset, batch_size=256)

    model = small_cnn(num_classes=10)
    errors = ModuleValidator.validate(model, strict=False)
    assert errors, "the BatchNorm layers are reported"
    model = ModuleValidator.fix(model)
    assert not ModuleValidator.validate(model, strict=False)

    device = torch.device("cpu")
    model = model.to(device)

    criterion = nn.CrossEntropyLoss()
    optimizer = optim.RMSprop(model.parameters(), lr=LR)

    privacy_engine = PrivacyEngine()

    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        epochs=EPOCHS,
        target_epsilon=EPSILON,
        target_delta=DELTA,
        max_grad_norm=MAX_GRAD_NORM,
    )

    print(f"Using sigma={optimizer.noise_multiplier} and C={MAX_GRAD_NORM}")

    loss_before = mean_loss(model, eval_loader)
    for epoch in range(EPOCHS):
        train(model, train_loader, optimizer, epoch + 1, device)
    return privacy_engine, loss_before, mean_loss(model, eval_loader)


ARGS = dict(n=256, delta=DELTA)
