"""``folder_paths.get_user_directory`` (ComfyUI's ``user/`` folder; tests set it)."""

user_directory = None


def get_user_directory():
    return user_directory


def set_user_directory(path):
    global user_directory
    user_directory = path
