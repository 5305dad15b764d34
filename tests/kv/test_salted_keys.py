"""Store keys under cache salts (``kv.hashing``): a salt's prompts chain from a root of their
own, so they share no key with the same tokens unsalted or under another salt, and still share
their prefixes among themselves; unsalted keys are those stores already hold."""

from __future__ import annotations

import pytest

from dualpath.kv.hashing import FORMAT_VERSION, block_keys, chain_key, extend_block_keys

BLOCK_SIZE = 4
FINGERPRINT = "0123456789abcdef" * 2
TOKEN_IDS = list(range(100, 100 + 4 * BLOCK_SIZE))  # exactly four full blocks


def test_unsalted_keys_are_the_ones_stores_already_hold() -> None:
    # Computed before salts existed: a change here orphans every stored block.
    assert FORMAT_VERSION == 1
    assert block_keys(list(range(8)), 4, FINGERPRINT) == [
        "2ac0f2e7fb81866dce0d03962ccbc98d",
        "04a27238942e29be1f13bc6c16b6bcf4",
    ]
    assert chain_key(None, [1, 2, 3, 4], FINGERPRINT) == "db804b40e6c31bfa02fd8bcc3820fc0b"
    assert block_keys(list(range(8)), 4, FINGERPRINT, cache_salt=None) == block_keys(
        list(range(8)), 4, FINGERPRINT
    )


def test_salted_key_derivation_is_pinned() -> None:
    # Salted keys name stored files too: a change here orphans every tenant's blocks.
    assert block_keys(list(range(8)), 4, FINGERPRINT, cache_salt="tenant-a") == [
        "3efa76608d3aa879b911720be6fad9ba",
        "5f709629b5c2dd409c29cb22f7129391",
    ]


def test_a_salted_prompt_shares_no_key_with_the_unsalted_one_or_another_salt() -> None:
    plain = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    salted_a = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT, cache_salt="a")
    salted_b = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT, cache_salt="b")
    assert len(salted_a) == len(salted_b) == len(plain) == 4
    assert not set(plain) & set(salted_a)
    assert not set(plain) & set(salted_b)
    assert not set(salted_a) & set(salted_b)


def test_salts_are_compared_as_whole_strings() -> None:
    keys = {
        salt: block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT, cache_salt=salt)[0]
        for salt in ("a", "A", "a ", "ab", "é", "e\u0301")
    }
    assert len(set(keys.values())) == len(keys)


def test_keys_of_one_salt_chain_and_share_prefixes() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT, cache_salt="a")
    parent = None
    expected = []
    for start in range(0, len(TOKEN_IDS), BLOCK_SIZE):
        block = TOKEN_IDS[start : start + BLOCK_SIZE]
        parent = chain_key(parent, block, FINGERPRINT, cache_salt="a")
        expected.append(parent)
    assert keys == expected
    longer = block_keys(TOKEN_IDS + [1] * BLOCK_SIZE, BLOCK_SIZE, FINGERPRINT, cache_salt="a")
    assert longer[:4] == keys  # the next turn of the tenant's conversation hits this one
    changed = list(TOKEN_IDS)
    changed[2 * BLOCK_SIZE] += 1
    changed_keys = block_keys(changed, BLOCK_SIZE, FINGERPRINT, cache_salt="a")
    assert changed_keys[:2] == keys[:2] and changed_keys[2] != keys[2]


def test_a_parent_carries_its_salt_so_extending_a_chain_needs_no_salt_again() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT, cache_salt="a")
    tail = TOKEN_IDS[2 * BLOCK_SIZE :]
    assert block_keys(tail, BLOCK_SIZE, FINGERPRINT, parent=keys[1]) == keys[2:]
    assert block_keys(tail, BLOCK_SIZE, FINGERPRINT, parent=keys[1], cache_salt="a") == keys[2:]
    grown: list[str] = []
    for num_blocks in (1, 3, 4):
        extend_block_keys(grown, TOKEN_IDS, num_blocks, BLOCK_SIZE, FINGERPRINT, cache_salt="a")
    assert grown == keys


def test_a_salt_spelling_a_block_key_does_not_continue_that_blocks_chain() -> None:
    # A salted root is tagged apart from a parent key: naming a block's key as the salt does
    # not reach the keys of that block's children.
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    second = TOKEN_IDS[BLOCK_SIZE : 2 * BLOCK_SIZE]
    assert chain_key(None, second, FINGERPRINT, cache_salt=keys[0]) != keys[1]
    assert chain_key(None, TOKEN_IDS[:BLOCK_SIZE], FINGERPRINT, cache_salt="0" * 32) != keys[0]


@pytest.mark.parametrize("bad_salt", ["", 7, b"a"])
def test_a_bad_salt_raises_value_error(bad_salt: object) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT, cache_salt=bad_salt)
    with pytest.raises(ValueError, match="cache_salt"):
        chain_key(None, TOKEN_IDS[:BLOCK_SIZE], FINGERPRINT, cache_salt=bad_salt)
