"""Adapters to serving frameworks; only ``integration.sglang`` imports sglang."""
