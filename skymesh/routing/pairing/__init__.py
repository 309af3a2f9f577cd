"""Prefill/decode pairs (Mooncake's Conductor): which replica runs a request's prefill,
which its decode, and whether to split them at all. One file per pair rule, one line in
:mod:`skymesh.routing.pair_registry`; the pricing they share is :mod:`.pricing`."""
