"""The fidelity measure itself: KL and top-1 agreement between two models' next-token distributions."""

from __future__ import annotations

import torch

from stages.export import fidelity


def test_top1_agreement_counts_a_near_tie_either_way_and_a_real_disagreement_as_one():
    p = torch.log_softmax(torch.tensor([[2.0, 2.0 + 1e-4, -1.0],     # tokens 0 and 1 all but tie
                                        [3.0, 0.0, -1.0]]), dim=-1)    # token 0 clearly first
    tie_broken_the_other_way = torch.tensor([[2.0 + 1e-4, 2.0, -1.0], [3.0, 0.0, -1.0]])
    kl, top1 = fidelity.compare([p], [tie_broken_the_other_way])
    assert top1 == 1.0 and float(kl.max()) < 1e-6
    wrong = torch.tensor([[2.0, 2.0, -1.0], [0.0, 3.0, -1.0]])        # the clear winner lost
    _, top1 = fidelity.compare([p], [wrong])
    assert top1 == 0.5
