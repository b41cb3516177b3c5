"""The boundary to SGLang: the only package of hisparse_sglang that imports sglang."""
