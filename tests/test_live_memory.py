"""`LiveTensors`' running totals (lit3d.strategies.telemetry.live_memory): what every layout's plan check reads on CPU
ranks."""

import torch

from lit3d.strategies.telemetry.live_memory import LiveTensors


def held_now(mode: LiveTensors) -> int:
    """What reading every tracked storage now gives (the totals must equal it after every operation)."""
    storages = (ref() for ref, made_by_collective, _ in list(mode._live.values()) if not made_by_collective)
    return sum(storage.nbytes() for storage in storages if storage is not None)


def test_the_totals_follow_new_freed_written_and_externally_resized_storages():
    weight = torch.zeros(1000)  # alive before the mode, as a parameter is
    with LiveTensors() as mode:
        a = torch.ones(250)  # 1,000 bytes
        b = a * 2  # 1,000 more
        assert mode.peak == held_now(mode) == 2000
        del a  # freed: taken off
        assert mode._held[False] == held_now(mode) == 1000
        b.resize_(500)  # written in place by an operation: read again
        assert mode._held[False] == held_now(mode) == 2000
        view = weight.view(10, 100)  # an input's storage: resizable where no mode sees it, as FSDP2's are
        assert mode._held[False] == held_now(mode) == 6000
        view.untyped_storage().resize_(0)  # (FSDP2's free: not an operation)
        c = torch.ones(1)  # the next operation reads it again
        assert mode._held[False] == held_now(mode) == 2004
        del c
    assert mode.peak == 6000 and mode.collective_copies == 0


def test_a_storage_freed_after_an_operation_listed_it_is_let_go():
    """A plan check crashed a LoRA run at ZeRO-3 with a KeyError: an operation lists the resizable storages to read
    again, and a garbage collection during that reading freed one it had listed (its record was gone at its turn)."""
    with LiveTensors() as mode:
        a, kept = torch.ones(4), torch.ones(8)
        listed = list(mode._live)  # as the operation lists them
        del a  # freed (by the collector, in the run) before its turn
        for key in listed:
            mode._read(key)
    assert mode._held[False] == held_now(mode) == kept.nbytes == 32 and mode.peak == 48
