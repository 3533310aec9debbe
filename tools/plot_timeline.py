"""Draw a per-request timeline (figures 8-5..8-7) from a scheduling run's JSON.

  python tools/plot_timeline.py --input=out/scheduling_chunked.json --output=timeline.png
"""
import json

from absl import app, flags

from jaxinfer.plotting import plot_timeline

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "JSON written by experiments.scheduling")
flags.DEFINE_string("output", "timeline.png", "PNG path")
flags.mark_flag_as_required("input")


def main(argv):
  del argv
  with open(FLAGS.input) as f:
    d = json.load(f)
  plot_timeline(d["requests"], d["steps"], FLAGS.output, d.get("title", ""))
  print(FLAGS.output)


if __name__ == "__main__":
  app.run(main)
