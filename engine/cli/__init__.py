"""The command lines: `python -m engine.train`, `engine.generate`, `engine.plan`,
`engine.launch` and `engine.prepare` run `main` of the module of the same name here;
`args` holds the parser helpers and the model, parallel and training flags they share."""
