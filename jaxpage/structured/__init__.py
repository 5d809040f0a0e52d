"""Layer 4, structured outputs: llguidance matchers per sequence and the token bitmasks they give the step."""
