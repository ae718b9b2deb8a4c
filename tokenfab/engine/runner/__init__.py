"""The model runner: builds the flat ForwardBatch, runs the model, samples; device set-up and the KV memory budget."""
