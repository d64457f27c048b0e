"""What a run trains on: the plan (cache or images, buckets, repeats), the datasets' weights, the distributed bucket
sampler, the loader and its micro-batches, and the check that a cache belongs to its model."""
