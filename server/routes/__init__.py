"""The route table every app is derived from, and the routes that belong to no API family: health, metrics, the
chat page and the render-only answer."""
