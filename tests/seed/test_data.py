import random

import numpy as np
import pytest
import torch

from probe.seed.data import dataloader_kwargs, make_generator, seed_worker
from probe.errors import SeedError


class WorkerDraws(torch.utils.data.Dataset):
    """Each item reports which worker made it and what numpy/random/torch drew there."""

    def __len__(self):
        return 12

    def __getitem__(self, index):
        info = torch.utils.data.get_worker_info()
        return {
            "index": index,
            "worker": info.id if info else -1,
            "numpy": float(np.random.rand()),
            "python": random.random(),
            "torch": float(torch.rand(1)),
        }


def _epoch(seed):
    loader = torch.utils.data.DataLoader(
        WorkerDraws(), batch_size=None, shuffle=True, num_workers=2, **dataloader_kwargs(seed))
    return [{key: (value.item() if torch.is_tensor(value) else value) for key, value in item.items()}
            for item in loader]


def test_dataloader_kwargs_repeat_shuffle_order_and_worker_randomness_and_workers_differ():
    first, again, other = _epoch(11), _epoch(11), _epoch(12)
    assert first == again
    assert [item["index"] for item in first] != [item["index"] for item in other]
    assert [item["numpy"] for item in first] != [item["numpy"] for item in other]
    # seed_worker gives each worker its own numpy and python streams
    by_worker = {w: [item for item in first if item["worker"] == w] for w in (0, 1)}
    assert by_worker[0] and by_worker[1]
    assert by_worker[0][0]["numpy"] != by_worker[1][0]["numpy"]
    assert by_worker[0][0]["python"] != by_worker[1][0]["python"]


def test_seed_worker_derives_numpy_and_python_seeds_from_the_torch_seed():
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        torch.manual_seed(2**32 + 77)  # seed_worker reduces it modulo 2**32
        seed_worker(0)
        assert np.random.rand() == np.random.RandomState(77).rand()
        assert random.random() == random.Random(77).random()
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


def test_make_generator_is_seeded_and_independent_of_the_global_rng():
    a, b = make_generator(3), make_generator(3)
    torch.rand(10)  # the global generator moving must not matter
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert make_generator(3).initial_seed() == 3
    assert not torch.equal(torch.rand(5, generator=make_generator(4)),
                           torch.rand(5, generator=make_generator(3)))


@pytest.mark.parametrize("seed", [-1, 2**32, True, "3", 2.0])
def test_bad_seed_for_generator_raises_seed_error_naming_make_generator(seed):
    with pytest.raises(SeedError, match="make_generator: seed is"):
        dataloader_kwargs(seed)
