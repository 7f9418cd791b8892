"""A user-style model for tests: build_stages(num_stages, **kwargs) -> list of stage modules."""

import torch.nn.functional as F
from torch import nn


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.out = nn.Linear(width, 2)

    def forward(self, x, targets):
        return F.cross_entropy(self.out(x), targets)  # a scalar mean loss, as users often write it


def build_stages(num_stages: int, width: int = 8) -> list[nn.Module]:
    stages: list[nn.Module] = [nn.Sequential(nn.Linear(4, width), nn.ReLU())]
    stages += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(num_stages - 2)]
    stages.append(Head(width))
    return stages
