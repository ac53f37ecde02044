"""The (epsilon, delta) of the clients' Gaussian noise (docs/PRIVACY.md, "Differential
privacy"), from Opacus' Renyi-DP accountant.

The mechanism: in each round it takes part in, a client releases u + N(0, (z C)^2 I)
for its update u clipped to ||u|| <= C (``dp-clip`` C, ``dp-noise-multiplier`` z;
``fedefc_client/mods.py``). That is the Gaussian mechanism with noise multiplier z for
the adjacency "one client's whole dataset added or removed" (L2 sensitivity C): a
client-level guarantee, per client, against whoever sees its update (the server, in
plain rounds). Its Renyi-DP at order a is a / (2 z^2) per round and adds up over rounds
(Mironov 2017); Opacus converts it to (epsilon, delta) with Balle et al. 2020, Thm. 21.

Sampling. The accountant can amplify by subsampling: with Poisson sampling at rate q
the same noise costs less. That holds only when the observer does not know who was
sampled. The project draws each round's clients from the run's seed
(``fedefc_server/plan.py: sample_round``), which the server and every node know,
so the guarantee this module reports (:attr:`DpGuarantee.epsilon`) composes the
mechanism over ALL the run's rounds with q = 1 (every client may be sampled in every
round; one that takes part in fewer rounds is better off). The amplified figure
(:attr:`DpGuarantee.epsilon_secret_sampling`, q = clients per round / num-clients) is
what a DP-FedAvg paper would report; it is given for comparison and is NOT a guarantee
of this code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .config import RunConfig

# The Renyi orders the accountant minimises over (Opacus' RDPAccountant.DEFAULT_ALPHAS).
ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def epsilon(noise_multiplier: float, rounds: int, delta: float,
            sampling_rate: float = 1.0) -> float:
    """epsilon at ``delta`` of ``rounds`` Gaussian releases of noise multiplier
    ``noise_multiplier``, each over a Poisson sample of rate ``sampling_rate`` (1.0: no
    sampling); inf without noise, 0.0 for no round."""
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must be in (0, 1)")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate={sampling_rate} must be in (0, 1]")
    if rounds < 0 or noise_multiplier < 0:
        raise ValueError(f"rounds={rounds} and noise_multiplier={noise_multiplier} must be "
                         ">= 0")
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    # Importing opacus loads its privacy engine and scipy.stats, measured at 3 to 5 s of
    # CPU: every per-message ClientApp process would pay it, most without needing it.
    from opacus.accountants.analysis import rdp  # lazy: saves 3 s of start-up
    curve = rdp.compute_rdp(q=sampling_rate, noise_multiplier=noise_multiplier,
                            steps=rounds, orders=list(ORDERS))
    return float(rdp.get_privacy_spent(orders=list(ORDERS), rdp=curve, delta=delta)[0])


@dataclass(frozen=True)
class DpGuarantee:
    """What a run's noise guarantees each client (module docstring)."""

    epsilon: float  # over every round, no amplification: the guarantee
    delta: float
    noise_multiplier: float
    rounds: int
    sampling_rate: float  # clients per round / num-clients
    epsilon_secret_sampling: float  # at sampling_rate, if the sample were secret: not ours

    def as_record(self) -> dict:
        """The fields, for summary.json (whose writer stores an infinite epsilon as null)."""
        return asdict(self)

    def describe(self) -> str:
        return (f"client-level DP: epsilon={self.epsilon:.3g} at delta={self.delta:g} over "
                f"{self.rounds} rounds (noise multiplier {self.noise_multiplier:g}; "
                f"{self.epsilon_secret_sampling:.3g} if the sampling at rate "
                f"{self.sampling_rate:.3g} were secret, which the seeded sampling is not)")


def run_guarantee(cfg: RunConfig, delta: float | None = None) -> DpGuarantee | None:
    """The guarantee of a run's ``dp-noise-multiplier`` over its ``rounds`` at ``delta``
    (default: the run's ``dp-delta``); None for a run without noise."""
    z = cfg.dp_noise_multiplier
    if z <= 0:
        return None
    delta = cfg.dp_delta if delta is None else delta
    q = cfg.clients_per_round / cfg.num_clients
    return DpGuarantee(epsilon(z, cfg.rounds, delta), delta, z, cfg.rounds, q,
                       epsilon(z, cfg.rounds, delta, q))
