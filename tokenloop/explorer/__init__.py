"""The explorer: a page (/explore) that shows the generation loop step by step, drawn from the engine's own record
(engine/trace.py): each stage of every step's distribution, how each token was chosen, branches and the KV blocks
they share. tree.py holds a tree's data, nodes.py a step's stages, session.py drives the engine, store.py bounds
what trees hold, routes.py serves the API and the static page."""
