"""What prefill and decode workers share: paged MLA cache, KDA state pool, scheduler, model
runner, sampler, request state, and the offline `LLM` / streaming `AsyncEngine` APIs."""
