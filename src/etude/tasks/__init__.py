"""Coding tasks: the task record, and (as they land) the feature-deletion factory and curriculum.

``etude.tasks.record`` holds the record every other part reads: one JSON line per task, a
superset of the SWE-bench instance schema, with the broken workspace beside it. Importing this
package imports nothing else; import the submodule you need.
"""
