"""Decoding methods: the shared prefill and plain decoding (``ar``), and the table
that gives each draft model its speculative decoder (``methods``)."""
