"""What every op builds on, and no op's own code: where a call runs and the Pallas
imports (`pallas`, `mosaic_gpu`: the only modules that import a Pallas backend), the
online-softmax states and their merges (`state`), the linear maps that give the ops'
derivatives in every mode (`linear_map`), the input checks (`inputs`), and the seam between
an op and its kernel backends (`backends`)."""
