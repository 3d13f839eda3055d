"""Batches of sequences: longest prompts first, within both bounds, every sequence once."""

from weft.generation.batches import plan_batches


def test_batches_keep_both_bounds_and_every_sequence_once():
    lengths = [5, 30, 12, 7, 30, 1, 19]
    batches = plan_batches(lengths, 10, max_batch_sequences=3, max_batch_tokens=100)
    assert sorted(i for batch in batches for i in batch) == list(range(7))
    for batch in batches:
        assert len(batch) <= 3 and len(batch) * (lengths[batch[0]] + 10) <= 100
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)
    assert plan_batches(lengths, 10) == [[1, 4, 6, 2, 3, 0, 5]]
