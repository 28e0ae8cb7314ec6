"""Chat in the frontend: which template renders (template_choice.py, with the tool-aware templates/ Tandem ships),
the renderer shared with the offline LLM (template.py), and earlier turns as templates expect them (history.py)."""
