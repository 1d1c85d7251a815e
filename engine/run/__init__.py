"""Running a model: the sharded step (`step`), the optimizer (`optim`), the data sampler
(`data`), checkpoints (`checkpoint`), the loop and its hooks (`loop`), KV-cache decoding
(`decode`), several processes (`distributed`), host memory (`host`) and MFU (`mfu`)."""
