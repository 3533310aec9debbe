"""`python -m jaxinfer generate --model smollm2-135m-instruct --prompt "..." [--chat] [--json]`."""
from jaxinfer.cli import main

if __name__ == "__main__":
  main()
