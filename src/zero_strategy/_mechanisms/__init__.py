"""Host and disk mechanisms the shards rest on: host<->device copies, the NVMe swap file.

Services with no model knowledge: they move bytes between the device, pinned host
buffers and the swap file. Layers and the import rule: docs/architecture.md.
"""
