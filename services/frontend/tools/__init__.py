"""Tool calling in the frontend: a Chat request's tools checked and planned (request.py, with the schema that
forces a tool_choice: choice_schema.py), their proto fields (convert.py), the model's text parsed into calls
(parsers/) and streamed out (output.py). docs/tools.md tells the whole path."""
