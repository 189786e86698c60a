"""Run outputs: metrics sinks, run directories, plots and the HTML report."""
