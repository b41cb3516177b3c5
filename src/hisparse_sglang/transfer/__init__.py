"""Mooncake transfer engine boundary: the only package of hisparse_sglang that imports mooncake."""
