"""What a flow process needs from its host: one GPU job per GPU (gpu_slot) and nothing outliving the process
(reaper). Neither knows about the stages; the flows call them around each stage and at start-up."""
