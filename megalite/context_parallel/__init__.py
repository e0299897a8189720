"""Context parallelism: sequences split over the CP group; attention over the whole sequence four ways
(:mod:`.attention`), the option checks (:mod:`.checks`) and the traffic accounting (:mod:`.traffic`)."""
