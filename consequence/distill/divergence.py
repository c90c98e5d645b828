"""Supervision a student can get from a frozen teacher (distillation box): the two kinds.

- a scalar per sampled token: :func:`reverse_kl_advantages` (credit box), the negated
  sampled-token reverse-KL estimate as a dense advantage (``--advantage reverse_kl``);
- the teacher's distribution: :func:`token_divergence` (update box), forward KL, reverse
  KL or GKD's JSD_β over the vocabulary as a loss (``--distill-loss``).

Both live in the box that uses them during training and are gathered here for library use.
"""

from consequence.credit.kl import reverse_kl_advantages
from consequence.update.divergence import token_divergence

__all__ = ["token_divergence", "reverse_kl_advantages"]
