"""Quantization schemes: how each ModelOpt format is planned (:mod:`.plan`), processed and run (:mod:`.schemes`)."""
