"""Communication: every call into ``torch.distributed``, bounded waits, failures, hybrid groups.

Knows flat buffers and labels, never modules or parameters. Layers and the import
rule: docs/architecture.md.
"""
