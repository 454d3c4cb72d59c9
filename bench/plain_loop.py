"""The GPU peer: the plainest fast PyTorch training loop, one device, one pre-built batch.

    python bench/plain_loop.py --model resnet50 --image-size 224 --batch-size 256 --steps 200 --out plain.json

bf16 autocast and channels_last on CUDA (no-ops on CPU), SGD with Nesterov momentum as raytrain uses,
the same uint8 -> normalised float conversion per step. Reports img/s over the steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import torchvision

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cudnn.benchmark = True
    net = torchvision.models.get_model(a.model, weights=None, num_classes=a.num_classes).to(device)
    if cuda:
        net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    images = torch.randint(0, 256, (a.batch_size, a.image_size, a.image_size, 3), dtype=torch.uint8, device=device)
    labels = torch.randint(0, a.num_classes, (a.batch_size,), device=device)
    mean, std = MEAN.to(device), STD.to(device)

    def step() -> None:
        x = images.permute(0, 3, 1, 2).float().sub_(mean).div_(std)
        x = x.contiguous(memory_format=torch.channels_last) if cuda else x.contiguous()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(net(x).float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    result = {
        "images_per_s": a.steps * a.batch_size / seconds,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(result)


if __name__ == "__main__":
    main()
